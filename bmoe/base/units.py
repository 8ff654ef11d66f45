"""Units shared by every module."""

MiB = 1 << 20
GB = 1_000_000_000  # file sizes as disks and model hubs state them
