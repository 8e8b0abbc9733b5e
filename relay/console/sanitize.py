"""The email's HTML made safe to show an operator: scripts, forms and every element that
makes the browser reach out (``link`` with its preconnect and prefetch hints, ``meta``
refresh, ``base``) dropped, and every URL but ``data:`` and ``cid:`` removed, by ammonia
(the ``nh3`` binding). The sandboxed frame and its policy stop scripts and fetches; this
stops what they do not cover (a preconnect tells the sender's tracker the email was opened)."""

from __future__ import annotations

import nh3

__all__ = ["clean_email_html"]

# what emails are laid out with, beyond ammonia's defaults
_TAGS = set(nh3.ALLOWED_TAGS) | {"style", "font", "center"}
_LAYOUT = {
    "style", "class", "id", "width", "height", "align", "valign", "bgcolor", "color",
    "border", "cellpadding", "cellspacing", "dir", "lang", "title", "face", "size",
}  # fmt: skip
_ATTRIBUTES = {tag: set(names) for tag, names in nh3.ALLOWED_ATTRIBUTES.items()}
_ATTRIBUTES["*"] = _ATTRIBUTES.get("*", set()) | _LAYOUT


def clean_email_html(html: str) -> str:
    """``html`` with nothing that runs or reaches out: what the frame shows."""
    return nh3.clean(
        html,
        tags=_TAGS,
        clean_content_tags={"script"},
        attributes=_ATTRIBUTES,
        url_schemes={"data", "cid"},
        link_rel=None,
        strip_comments=True,
    )
