"""The rank server's last preload (tests/ranks.py): what the imports made moves out of the cyclic collector's sight
(`gc.freeze`), so the ranks forked from it do not scan the ~million import-time objects in every full collection
(the memory trackers collect at each start, and Python's own full collections) nor copy the pages a scan touches.
Objects made after the fork are collected as usual; no tensor exists in the server to be hidden."""
import gc

gc.freeze()
