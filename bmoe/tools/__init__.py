"""bmoe-bench and bmoe-synth: benchmarks and synthetic models, beside the product (an edge: nothing
below the edges imports them)."""
