"""`colo top`: a Textual view of GPUs, jobs, budgets and the queue, fed only by `colo.client`."""
