"""Which model file a run uses: the path it was given, a model named on the Hugging Face hub
(`-hf`, downloaded into its cache once: bmoe.api.hub) or, with neither, the demo model (built on
first use, bmoe.demo.build) with a cache budget of about a quarter of its experts.

Every edge (bmoe-cli, the session, bmoe-server, bmoe.load) resolves its model here, so the
no-argument runs of each are the same run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from bmoe.base.errors import ConfigError
from bmoe.base.settings import Settings


def resolve(s: Settings, progress: Callable[[str], None]) -> Settings:
    """`s` with its model: as given, downloaded by name (`hf`), or (neither) the demo model and,
    unless the cache was sized, the demo's budget. `progress` hears of a download or a first-use
    build. ConfigError when a named model cannot be had, --chat-template-file cannot be read or --chat-template
    names no template llama.cpp has."""
    if s.chat_template_file:
        try:
            Path(s.chat_template_file).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"the chat template {s.chat_template_file} cannot be read "
                              f"({getattr(e, 'strerror', None) or e}); give a jinja template file") from None
    if s.chat_template:
        from bmoe.seam.llama import builtin_templates

        names = builtin_templates()
        if s.chat_template not in names:
            raise ConfigError(f"the chat template {s.chat_template!r} is not one of llama.cpp's built-in templates "
                              f"({', '.join(names)}); give a jinja template file instead")
    if s.hf:
        from bmoe.api import hub

        return replace(s, model=str(hub.fetch(hub.parse(s.hf), progress)))
    if s.model:
        return s
    from bmoe.demo.build import default_model

    path, demo_cache_mb = default_model(progress=progress)
    cache = s.cache
    if cache.mb is None and cache.floor_mb is None and cache.ceil_mb is None:
        cache = replace(cache, mb=demo_cache_mb)
    return replace(s, model=str(path), cache=cache)
