"""What distlab keeps per shape, the most recent first out last: ``kept(cache, key, build, size)``.

    python -m pytest tests/test_ring_kept.py tests/test_packed.py    # the plans kept this way, tested there

Used for the packed-document plans (``distlab.cp.documents.cached_plan``) and the ring's kept FA4 outputs
(``distlab.cp.ring_kept.kept_forward``): building either costs host time every layer and step would pay again.
"""

from __future__ import annotations

import collections


def kept(cache: collections.OrderedDict, key, build, size: int):
    """``cache[key]``, made by ``build()`` the first time; the least recently used entries beyond ``size`` are
    dropped (their memory goes when nothing else holds them)."""
    value = cache.get(key)
    if value is None:
        value = cache[key] = build()
        while len(cache) > size:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return value
