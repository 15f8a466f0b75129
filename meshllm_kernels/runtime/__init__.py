"""What kernel launchers share: entry checks, the PDL hand-off, counters, staged copies."""
