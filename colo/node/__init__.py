"""The machine colo runs on: NVML (`gpu`), MPS control daemons (`mps`), cgroups (`cgroup`), the
interposer's ledgers (`interposer`), the simulated driver's controls (`fakegpu`) and where the
compiled parts live (`native`). Nothing here knows about jobs' queue or policy."""
