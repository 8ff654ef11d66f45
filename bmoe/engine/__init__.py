"""The engine's parts: the load and everything wired around it (`load`) and what an edge prints about
it (`engine_stats`). `Engine` itself, which runs them (KV sequences, decode), is bmoe.coordinator.
"""
