# The SPANK plugin is built only where Slurm's headers are (Debian: libslurm-dev); colo works without it.
SLURM_INC ?= /usr/include
ifneq ($(wildcard $(SLURM_INC)/slurm/spank.h),)
$(BUILD)/colo_spank.so: slurm/colo_spank.c | $(BUILD)
	$(CC) $(CFLAGS) -I$(SLURM_INC) -shared -o $@ slurm/colo_spank.c

slurm: $(BUILD)/colo_spank.so
else
slurm:
endif
