"""asyncsync inside other libraries' training loops, one module per library (``trl``).

Each module imports its library only when one of its names is used, and nothing in asyncsync's core
imports this package: a trainer that never uses an integration never loads it.
"""
