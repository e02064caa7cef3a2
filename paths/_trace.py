import os, time
def tr(what):
    p = os.environ.get("PT")
    if p:
        with open(p, "a") as f:
            f.write(f"{time.time():.3f} {os.getpid()} {what}\n")
