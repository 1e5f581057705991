"""The `colo` command: parses, asks the daemon through colo.client, prints. Nothing here schedules
or touches a GPU. `entry` picks the short paths (`submitspec`, `lsview`) that skip typer; `app` is
the typer app for the rest. Kept empty so `import colo.cli.entry` stays cheap."""
