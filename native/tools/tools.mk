# Small C helpers. colo-burn reaches the driver only through dlopen("libcuda.so.1").
$(BUILD)/colo-burn: tools/burn.c | $(BUILD)
	$(CC) $(CFLAGS) -o $@ tools/burn.c $(LDLIBS)

tools: $(BUILD)/colo-burn
