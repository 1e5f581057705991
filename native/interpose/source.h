/* Where a job's budget comes from (source.c): what colo wrote where the job cannot change it, not
 * the job's own environment. */
#ifndef COLO_SOURCE_H
#define COLO_SOURCE_H

#include <stdint.h>

/* 1: this process is a colo job's. The budget (bytes per device) and the ledger's path are taken
 * from colo's root-owned `budget` file beside the ledger (in a container, always colo's own mount
 * /opt/colo/run); or, when that file is missing or not colo's, *error says why every counted
 * allocation is refused. The environment's COLO_GPU_BUDGET is not read, and COLO_GPU_MANAGED is
 * set to the file's policy (hooks.c reads it next).
 * 0: not a colo job's process (`colo run-budgeted`, tests): the environment says it all. */
int budget_source(uint64_t *budget, const char **ledger, const char **error);

#endif
