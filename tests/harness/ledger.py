"""A job that rewrites its own budget ledger as an attacker would (issue 31, attack 4): 65,536 slots
claimed, every slot marked owned, the 1,024 slots colo made held by one process. Run by
test_budget_source.py and bench/ledger_bench.py (with PYTHONPATH at the repository)."""

CRAFT = """
import fcntl, os, struct, time
from colo.node import interposer as I
fd = os.open(os.environ["COLO_LEDGER"], os.O_RDWR)
n = 65536
os.ftruncate(fd, I.HEADER_SIZE + n * I.SLOT_SIZE)
h = bytearray(os.pread(fd, I.HEADER_SIZE, 0))
v = list(I._HEAD.unpack_from(h, 0))
v[3] = v[10] = n
I._HEAD.pack_into(h, 0, *v)
os.pwrite(fd, bytes(h), 0)
for i in range(n):
    os.pwrite(fd, struct.pack("<IIi", 1, 0, os.getpid()), I.HEADER_SIZE + i * I.SLOT_SIZE)
for i in range(1024):
    off = I.HEADER_SIZE + i * I.SLOT_SIZE
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, I._FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, off, 1, 0))
    fcntl.fcntl(fd, fcntl.F_SETLK, I._FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, off + 1, 1, 0))
print("crafted", os.getpid(), flush=True)
time.sleep(600)
"""
