"""One object a thread, made by the thread's first call: the engine's state and the kernels'
view of it are each per thread, as torch's autocast state is.

>>> import threading
>>> counter = per_thread(list, "This thread's list.")
>>> counter().append(1); counter()
[1]
>>> seen = []
>>> t = threading.Thread(target=lambda: seen.append(counter())); t.start(); t.join()
>>> seen
[[]]
"""

from __future__ import annotations

import threading


def per_thread(factory, doc: str):
    """A function returning this thread's own ``factory()``, made at the thread's first call."""
    local = threading.local()

    def get():
        try:
            return local.value
        except AttributeError:
            value = local.value = factory()
            return value

    get.__doc__ = doc
    return get
