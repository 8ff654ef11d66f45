"""The memory a run may use: the limits that apply to the process and the room each leaves
(`probe`), the cache budget they allow (`budget`), and the dense weights kept mapped (`dense`).
"""
