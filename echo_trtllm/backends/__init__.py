"""Adapters to other serving stacks; each imports its stack lazily and is never a required dependency."""
