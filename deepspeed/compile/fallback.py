"""One place for the decision "DeepCompile cannot run this configuration; use plain torch.compile"."""
from deepspeed.utils import logger


def fall_back(what: str, why: str) -> None:
    """Log one clear warning and return ``None``: the engine then compiles with plain ``torch.compile``."""
    logger.warning(f"deepspeed-compile: {what} is not supported ({why}); "
                   "falling back to plain torch.compile without DeepCompile")
    return None
