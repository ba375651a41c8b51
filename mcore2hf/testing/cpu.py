from mcore2hf.runtime.cpu import *  # noqa: F403 - moved to mcore2hf.runtime.cpu (one release of this path)
