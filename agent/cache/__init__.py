"""The NVMe model cache: the pure plan, the disks and their commands, the run, its settings."""
