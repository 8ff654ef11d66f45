"""Tools beside the product: benchmarks, model builders, policy simulation. The coordinator never imports them."""
