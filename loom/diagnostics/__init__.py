"""Why a job hangs, why it is slow, and whether the cluster can run it."""
