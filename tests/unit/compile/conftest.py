"""Test set-up: the checkout's ``deepspeed.compile`` is the one under test (see ``checkout.py``)."""
import checkout  # noqa: F401
