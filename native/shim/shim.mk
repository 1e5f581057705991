shim: $(BUILD)/colo-shim
$(BUILD)/colo-shim: shim/colo-shim.c | $(BUILD)
	$(CC) $(CFLAGS) -o $@ $<
.PHONY: shim
