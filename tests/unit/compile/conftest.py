# SPDX-License-Identifier: Apache-2.0
"""Test set-up: the checkout's ``deepspeed.compile`` is the one under test (see ``checkout.py``)."""
import checkout

checkout.use_checkout()  # idempotent: importing checkout has run it already (spawned ranks rely on the import)
