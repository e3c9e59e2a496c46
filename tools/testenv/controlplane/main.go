// Command controlplane runs kube-apiserver, kube-controller-manager,
// kube-scheduler, kubelet or etcd, chosen by its first argument or by the name
// it was invoked under (symlinks), so the test cluster links one binary.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

var commands = map[string]func() *cobra.Command{
	"kube-apiserver":          apiserver.NewAPIServerCommand,
	"kube-controller-manager": controllermanager.NewControllerManagerCommand,
	"kube-scheduler":          func() *cobra.Command { return scheduler.NewSchedulerCommand() },
	"kubelet":                 func() *cobra.Command { return kubelet.NewKubeletCommand(context.Background()) },
}

func main() {
	name := filepath.Base(os.Args[0])
	args := os.Args[1:]
	if _, ok := commands[name]; !ok && name != "etcd" {
		if len(args) == 0 {
			usage()
		}
		name, args = args[0], args[1:]
	}
	if name == "etcd" {
		etcdmain.Main(append([]string{"etcd"}, args...))
		return
	}
	newCommand, ok := commands[name]
	if !ok {
		usage()
	}
	command := newCommand()
	command.SetArgs(args)
	os.Exit(cli.Run(command))
}

func usage() {
	names := []string{"etcd"}
	for n := range commands {
		names = append(names, n)
	}
	fmt.Fprintf(os.Stderr, "usage: controlplane {%s} [flags]\n", strings.Join(names, "|"))
	os.Exit(2)
}
