"""Command line."""
def main():
    print("ok")
