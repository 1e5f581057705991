"""Pure scheduling: the policy (`plan()`), fair share, the co-run model, and the simulator with its
truths. No I/O beyond reading workload files; the daemon and `colo sim` both call `policy`, and
`policy` never imports the simulator's truths."""
