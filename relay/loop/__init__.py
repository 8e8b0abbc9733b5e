"""The relay loop's services, each with one job; :class:`relay.worker.Relay` orders them.

See docs/design.md, "The relay loop's services", for who owns what and in which order.
"""

__all__: list[str] = []
