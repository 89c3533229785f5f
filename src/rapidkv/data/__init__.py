"""Data sets users benchmark with, read offline from installed packages."""
