"""O_DIRECT reads of expert-sized slices at random offsets of a file, paced to RATE MiB/s, into a shared buffer:
the I/O a streaming decode does, without bmoe. Runs until killed."""
import mmap, os, random, sys, time
path, rate = sys.argv[1], float(sys.argv[2])
SL = 864 << 10
fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
size = os.fstat(fd).st_size
buf = mmap.mmap(-1, 64 * SL)
view = memoryview(buf)
t0 = time.perf_counter(); done = 0; i = 0
while True:
    off = random.randrange(0, size - SL) // 4096 * 4096
    os.preadv(fd, [view[(i % 64) * SL:(i % 64 + 1) * SL]], off)
    i += 1; done += SL
    ahead = done / (rate * 2**20) - (time.perf_counter() - t0)
    if ahead > 0:
        time.sleep(ahead)
