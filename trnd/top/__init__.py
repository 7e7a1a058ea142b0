"""`trnd top`: a Textual operator console over every node's /admin/state (see trnd/top/cli.py)."""
