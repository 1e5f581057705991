"""Notebooks' kernels as colo jobs: jupyter_client's kernel provisioner `colo` (provisioner.py, loaded
by Jupyter through the `jupyter_client.kernel_provisioners` entry point) and the kernelspec that
names it (kernelspec.py, written by `colo kernelspec install`). A client of the daemon, as the
CLI is: it reaches colo through colo.client only."""
