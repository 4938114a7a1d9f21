# SPDX-License-Identifier: Apache-2.0
"""What DeepCompile does for the libraries users train with around DeepSpeed: DeepSpeed's activation checkpointing
(``ds_checkpointing.py``), Accelerate's regional compilation (``accelerate.py``) and ``transformers``' models
(``transformers.py``)."""
