"""pddlink.transfer"""
