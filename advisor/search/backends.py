"""The search's view of the backend layer; the registry itself is the public `advisor.backends`."""

from ..backends import (  # noqa: F401
    Backend,
    FunctionBackend,
    Measure,
    backend_names,
    check_usable,
    default_backend_name,
    get_backend,
    register_backend,
    source_of,
    unregister_backend,
)
