"""Recorded routes replayed offline: statistics of a trace (`stats`), every cache policy and
Belady's optimum over it (`policies`, `bounds`). `bmoe-bench routes` and `policies` print these.
"""

from bmoe.replay.stats import ReplayBudget
