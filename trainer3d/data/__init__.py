from trainer3d.data.pipeline_old import *  # noqa: F401,F403  (temporary, while the module is split)
from trainer3d.data.pipeline_old import BUNDLED_TOKENIZER_DIR, DataError  # noqa: F401
