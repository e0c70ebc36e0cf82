"""memunreachable: find unreachable (leaked) native memory in a running glibc Linux process."""
__version__ = "0.1.0"
