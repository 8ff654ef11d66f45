"""bmoe-synth's architectures, one module each (as mlx-lm's models/): each registers its `Arch`
(bmoe.tools.synth_parts) with its tensor table, metadata keys and small shape; bmoe.tools.synth_archs
imports every module here and serves the registry to the rest of bmoe-synth."""
