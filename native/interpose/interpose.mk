# The memory-budget interposer: $(BUILD)/libcolo-interpose.so (LD_PRELOAD; no CUDA headers).
INTERPOSE_SRC := $(addprefix interpose/,hooks.c ledger.c table.c)
INTERPOSE_HDR := $(addprefix interpose/,cuda_types.h glibc_compat.h ledger.h table.h)

interpose: $(BUILD)/libcolo-interpose.so

# -Bsymbolic: our own references to the names we export stay ours. -ldl/-lpthread stay NEEDED so
# the library also loads on glibc < 2.34, where they are separate libraries.
$(BUILD)/libcolo-interpose.so: $(INTERPOSE_SRC) $(INTERPOSE_HDR) interpose/interpose.map | $(BUILD)
	$(CC) $(CFLAGS) -fvisibility=hidden -include interpose/glibc_compat.h -shared -o $@ $(INTERPOSE_SRC) \
		-Wl,--version-script=interpose/interpose.map -Wl,-Bsymbolic -Wl,--no-as-needed -l:libdl.so.2 -l:libpthread.so.0
