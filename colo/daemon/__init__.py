"""The colo daemon: socket server, scheduler loop, launcher, monitor and recovery."""
