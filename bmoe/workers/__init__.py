"""The worker processes the coordinator starts (`python -P -m bmoe.workers.NAME`, see `command`): I/O lanes that read
expert slices into the slab (`io_lane`), the spec-gate that predicts the next layer's routing
(`spec_gate`, with the router weights and the next-layer recipe it computes, `routers`, which offline
replays use too) and the throwaway process that checks a new grammar (`grammar_worker`). They import
only what moves bytes or predicts."""


from bmoe.workers.launch import command
