"""Units shared by every module."""

MiB = 1 << 20
