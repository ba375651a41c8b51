from mcore2hf.runtime.tiny import *  # noqa: F403 - moved to mcore2hf.runtime.tiny (one release of this path)
