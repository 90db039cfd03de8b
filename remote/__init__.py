"""Tether's remote half: the tracker, the device server and the client.

The notebook entry point is ``from remote import rpc``. This file stays
import-free because a board imports it too (``python -m remote.server``).
"""
__version__ = "0.1.0"
