"""Former home of mcore2hf.runtime (CPU shims, tiny models): the documented module paths cpu and tiny here
re-export it for one release."""
