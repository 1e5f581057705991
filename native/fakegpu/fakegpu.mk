# Simulated NVIDIA driver (libcuda.so.1, libnvidia-ml.so.1, nvidia-cuda-mps-control) and its
# state CLI. Internal symbols are hidden and the libraries bound with -Bsymbolic, so their own
# calls never land in an LD_PRELOADed interposer.
FG_DIR  := $(BUILD)/fakegpu
FG_HDR  := fakegpu/fakegpu.h
FG_LIB  := -shared -fvisibility=hidden -Wl,-Bsymbolic -Wl,--no-undefined

FG_CUDA_SRC := fakegpu/cuda.c fakegpu/cuda_mem.c fakegpu/cuda_async.c fakegpu/procaddr.c fakegpu/cuda_share.c fakegpu/cuda_module.c fakegpu/mps_client.c fakegpu/checkpoint.c fakegpu/state.c

$(FG_DIR)/libcuda.so.1: $(FG_CUDA_SRC) $(FG_HDR) fakegpu/cuda_internal.h | $(FG_DIR)
	$(CC) $(CFLAGS) $(FG_LIB) -Wl,-soname,libcuda.so.1 -o $@ $(FG_CUDA_SRC) $(LDLIBS)
	ln -sf libcuda.so.1 $(FG_DIR)/libcuda.so

$(FG_DIR)/libnvidia-ml.so.1: fakegpu/nvml.c fakegpu/state.c $(FG_HDR) | $(FG_DIR)
	$(CC) $(CFLAGS) $(FG_LIB) -Wl,-soname,libnvidia-ml.so.1 -o $@ fakegpu/nvml.c fakegpu/state.c $(LDLIBS)
	ln -sf libnvidia-ml.so.1 $(FG_DIR)/libnvidia-ml.so

$(FG_DIR)/nvidia-cuda-mps-control: fakegpu/mps_control.c fakegpu/state.c $(FG_HDR) | $(FG_DIR)
	$(CC) $(CFLAGS) -o $@ fakegpu/mps_control.c fakegpu/state.c $(LDLIBS)

$(BUILD)/colo-fakegpu: fakegpu/ctl.c fakegpu/state.c $(FG_HDR) | $(BUILD)
	$(CC) $(CFLAGS) -o $@ fakegpu/ctl.c fakegpu/state.c $(LDLIBS)

fakegpu: $(FG_DIR)/libcuda.so.1 $(FG_DIR)/libnvidia-ml.so.1 $(FG_DIR)/nvidia-cuda-mps-control $(BUILD)/colo-fakegpu
