# colo: the command users run (installed as bin/colo; setup.py's build_scripts). The hot commands go to
# a per-user command server (colo/cli/fastserve.py), everything else to the Python script bin/colo-py.
$(BUILD)/colo-client: client/colo.c | $(BUILD)
	$(CC) $(CFLAGS) -o $@ client/colo.c

client: $(BUILD)/colo-client
