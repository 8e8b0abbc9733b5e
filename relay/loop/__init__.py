"""The relay loop's services, each with one job; :class:`relay.worker.Relay` orders them.

See docs/design.md, "The relay loop's services", for who owns what and the rules between them.
"""

__all__: list[str] = []
