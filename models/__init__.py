"""Model families written as pure functions over parameter pytrees: ``init``, ``specs``, ``apply``."""
