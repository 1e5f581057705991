# Small C helpers. colo-burn reaches the driver only through dlopen("libcuda.so.1").
$(BUILD)/colo-burn: tools/burn.c | $(BUILD)
	$(CC) $(CFLAGS) -o $@ tools/burn.c $(LDLIBS)

tools: $(BUILD)/colo-burn

# colo-pin: opens a mount source as its user, no symlinks followed, and hands the fd to the daemon.
$(BUILD)/colo-pin: tools/pin.c | $(BUILD)
	$(CC) $(CFLAGS) -o $@ tools/pin.c

tools: $(BUILD)/colo-pin

# colo-devcg: a cgroup v2 device program (raw bpf(), hand-written instructions: no libbpf, no clang).
$(BUILD)/colo-devcg: tools/devcg.c | $(BUILD)
	$(CC) $(CFLAGS) -o $@ tools/devcg.c

tools: $(BUILD)/colo-devcg

# colo-ckpt: the driver's cuCheckpointProcess* calls on a job's pids (suspend/resume), via dlopen.
$(BUILD)/colo-ckpt: tools/ckpt.c | $(BUILD)
	$(CC) $(CFLAGS) -o $@ tools/ckpt.c $(LDLIBS)

tools: $(BUILD)/colo-ckpt
