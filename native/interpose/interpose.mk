# The memory-budget interposer: $(BUILD)/libcolo-interpose.so (LD_PRELOAD; no CUDA headers).
INTERPOSE_SRC := $(addprefix interpose/,gate.c gotpatch.c hooks.c ledger.c passthru.c pools.c table.c)
INTERPOSE_HDR := $(addprefix interpose/,ctxid.h cuda_types.h glibc_compat.h gotpatch.h ledger.h pools.h table.h)

interpose: $(BUILD)/libcolo-interpose.so
INTERPOSE_SRC += interpose/source.c
INTERPOSE_HDR += interpose/source.h

# -Bsymbolic: our own references to the names we export stay ours. Only libc.so.6 is NEEDED (see
# glibc_compat.h): what lived in libdl/libpthread before glibc 2.34 is reached by weak references.
# passthru.c's stubs: driver_api.list as X(name) lines, comments and blank lines left out.
$(BUILD)/driver_api.inc: interpose/driver_api.list | $(BUILD)
	sed -n 's/^\(cu[A-Za-z0-9_]*\)[[:space:]]*$$/X(\1)/p' $< > $@

$(BUILD)/libcolo-interpose.so: $(INTERPOSE_SRC) $(INTERPOSE_HDR) interpose/interpose.map $(BUILD)/driver_api.inc | $(BUILD)
	$(CC) $(CFLAGS) -I$(BUILD) -fvisibility=hidden -include interpose/glibc_compat.h -shared -o $@ $(INTERPOSE_SRC) \
		-Wl,--version-script=interpose/interpose.map -Wl,-Bsymbolic
