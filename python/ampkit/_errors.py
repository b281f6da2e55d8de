"""ampkit's own exception types, in a module of their own so that every module can raise
them without importing the module that holds policies (whose loading needs the op names)."""


class PolicyError(ValueError):
    """A cast policy (file, name, op, category, dtype or device) is invalid."""
