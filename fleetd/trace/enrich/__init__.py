"""What user space adds to a record: ``stacks`` (user stacks, kernel
names, wait channels), ``symbols`` (names for addresses), ``pyframes``, ``pydebug`` and
``pyusdt`` (Python frames and garbage collections), ``oncpu`` (on-CPU samples) and
``fdpeers`` (the file or peer behind a blocked read or write).
"""
